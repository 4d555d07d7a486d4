-- Fleet state: halls, pools, instances and their lifecycle, the acquirer's token budget, every event.

CREATE TABLE hall (
    name        text PRIMARY KEY CHECK (name ~ '^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$'),
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- A pool is flavor x availability zone x kind; platform says whether Nova boots a VM or Ironic a bare-metal node.
CREATE TABLE pool (
    hall               text NOT NULL REFERENCES hall (name),
    name               text NOT NULL CHECK (name ~ '^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$'),
    flavor             text NOT NULL,
    availability_zone  text NOT NULL DEFAULT '',
    kind               text NOT NULL CHECK (kind IN ('reclaimable', 'committed', 'on-demand')),
    platform           text NOT NULL DEFAULT 'vm' CHECK (platform IN ('vm', 'baremetal')),
    image              text NOT NULL,
    unavailable_until  timestamptz,
    unavailable_reason text,
    PRIMARY KEY (hall, name)
);

CREATE TABLE instance (
    id             bigserial PRIMARY KEY,
    hall           text NOT NULL,
    pool           text NOT NULL,
    plan_entry     text NOT NULL,
    slot           integer NOT NULL CHECK (slot >= 0),
    name           text NOT NULL,
    server_id      text UNIQUE,
    state          text NOT NULL CHECK (state IN (
                       'requested', 'launching', 'active', 'failed',
                       'notified', 'draining', 'drained', 'overrun', 'deleting', 'deleted')),
    reclaim_id     text,
    terminate_at   timestamptz,
    created_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    FOREIGN KEY (hall, pool) REFERENCES pool (hall, name)
);
-- One live instance per slot; a deleted one leaves its slot free for a later launch.
CREATE UNIQUE INDEX instance_live_slot ON instance (hall, pool, plan_entry, slot) WHERE state NOT IN ('deleted', 'failed');
CREATE INDEX instance_by_name ON instance (hall, name);
CREATE INDEX instance_due ON instance (terminate_at) WHERE state IN ('notified', 'draining', 'drained', 'overrun');

CREATE TABLE lifecycle_event (
    id           bigserial PRIMARY KEY,
    hall         text NOT NULL,
    instance_id  bigint REFERENCES instance (id),
    pool         text,
    kind         text NOT NULL,
    at           timestamptz NOT NULL DEFAULT clock_timestamp(),
    detail       jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX lifecycle_event_instance ON lifecycle_event (instance_id, at);
CREATE INDEX lifecycle_event_hall ON lifecycle_event (hall, at);
-- The agent's events arrive at least once (JetStream redelivers): one row per agent event.
CREATE UNIQUE INDEX lifecycle_event_agent_seq ON lifecycle_event (hall, (detail ->> 'node'), ((detail ->> 'seq')::bigint))
    WHERE kind LIKE 'agent.%';

-- API calls per minute, shared by every acquirer run against one cloud.
CREATE TABLE token_bucket (
    name               text PRIMARY KEY,
    capacity           double precision NOT NULL CHECK (capacity > 0),
    refill_per_minute  double precision NOT NULL CHECK (refill_per_minute > 0),
    tokens             double precision NOT NULL,
    updated_at         timestamptz NOT NULL DEFAULT clock_timestamp()
);
