-- Day two (issue 18): on-demand spend against the arbiter's authority, and when each node's agent was last heard.

-- What a decision was made against: the contract's tier and its spend authority per hour
-- (fallback.spendCapPerHour) when the arbiter decided. NULL on rows written before this migration.
ALTER TABLE arbitration_record ADD COLUMN tier integer;
ALTER TABLE arbitration_record ADD COLUMN authority_per_hour numeric(14, 2) CHECK (authority_per_hour >= 0);

-- One sample per arbitrate run and contract tier, all rows of a run at one time (the transaction's): the on-demand
-- spend per hour of the running fleet the arbiter counted, what it granted on top in that run, and the tier's
-- authority per hour (the sum of its on-demand contracts' caps). Spend over a period is the step function of the
-- samples in time (a sample holds until the next run's). Tier 0: instances of contracts no longer in the bundle.
CREATE TABLE spend_record (
    id                  bigserial PRIMARY KEY,
    hall                text NOT NULL REFERENCES hall (name),
    run_id              bigint REFERENCES control_run (id),
    tier                integer NOT NULL CHECK (tier >= 0),
    spend_per_hour      numeric(14, 2) NOT NULL CHECK (spend_per_hour >= 0),
    granted_per_hour    numeric(14, 2) NOT NULL CHECK (granted_per_hour >= 0),
    authority_per_hour  numeric(14, 2) NOT NULL CHECK (authority_per_hour >= 0),
    created_at          timestamptz NOT NULL DEFAULT now(),
    UNIQUE (hall, created_at, tier)
);

-- The last heartbeat of each node's agent the control loop (or sco hall status) read from the relay's heartbeat
-- stream: heard_at is the relay's time of that message (JetStream's), never the node's clock. It only moves forward.
CREATE TABLE agent_heartbeat (
    hall          text NOT NULL REFERENCES hall (name),
    node          text NOT NULL,
    heard_at      timestamptz NOT NULL,
    detail        jsonb NOT NULL DEFAULT '{}',
    collected_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (hall, node)
);

-- When the heartbeats were last read for the hall and how the last try went (a reader that stopped reading would
-- make every agent look silent: the status says when it last read, and why the last try failed).
CREATE TABLE heartbeat_collection (
    hall          text PRIMARY KEY REFERENCES hall (name),
    collected_at  timestamptz,
    nodes         integer NOT NULL DEFAULT 0 CHECK (nodes >= 0),
    tried_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    error         text
);
