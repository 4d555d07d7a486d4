-- The control loop's record (issue 11): runs, plans, arbitration decisions, and the contract subset of each plan entry.

-- One row per control-loop run; summary = what was demanded, planned, launched, deleted, granted, refused.
CREATE TABLE control_run (
    id           bigserial PRIMARY KEY,
    hall         text NOT NULL REFERENCES hall (name),
    started_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at  timestamptz,
    status       text NOT NULL DEFAULT 'running' CHECK (status IN ('running', 'ok', 'failed')),
    runner_ident text,
    summary      jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX control_run_hall ON control_run (hall, started_at);

-- Every plan the planner made (not in check mode): what it does (body) and why (decisions).
CREATE TABLE plan_record (
    id          bigserial PRIMARY KEY,
    hall        text NOT NULL REFERENCES hall (name),
    run_id      bigint REFERENCES control_run (id),
    digest      text NOT NULL,
    changed     boolean NOT NULL,
    body        jsonb NOT NULL,
    decisions   jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX plan_record_hall ON plan_record (hall, created_at);

-- Every grant and refusal of the fallback arbiter, with its reason.
CREATE TABLE arbitration_record (
    id             bigserial PRIMARY KEY,
    hall           text NOT NULL REFERENCES hall (name),
    run_id         bigint REFERENCES control_run (id),
    contract       text NOT NULL,
    outcome        text NOT NULL CHECK (outcome IN ('grant', 'refuse')),
    pool           text,
    instances      integer NOT NULL DEFAULT 0 CHECK (instances >= 0),
    units_milli    bigint NOT NULL DEFAULT 0 CHECK (units_milli >= 0),
    cost_per_hour  numeric(14, 2) NOT NULL DEFAULT 0,
    reason         text NOT NULL CHECK (reason <> ''),
    created_at     timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX arbitration_record_hall ON arbitration_record (hall, created_at);

-- A plan entry is a pool's instances launched with one contract subset (the acquirer holds a count per entry).
CREATE TABLE plan_entry (
    hall        text NOT NULL,
    pool        text NOT NULL,
    entry       text NOT NULL,
    contracts   text[] NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (hall, pool, entry),
    FOREIGN KEY (hall, pool) REFERENCES pool (hall, name)
);
