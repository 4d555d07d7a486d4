-- Reconciliation with Nova (issue 17): an instance whose server vanished outside the product is `lost`, with when
-- Nova last listed it. A lost instance is no capacity and holds no slot; its record and events stay.

ALTER TABLE instance DROP CONSTRAINT instance_state_check;
ALTER TABLE instance ADD CONSTRAINT instance_state_check CHECK (state IN (
    'requested', 'launching', 'active', 'failed',
    'notified', 'draining', 'drained', 'overrun', 'deleting', 'deleted', 'lost'));

-- When a reconciliation last saw the server in Nova's list (NULL: never listed since this column exists).
ALTER TABLE instance ADD COLUMN last_seen_at timestamptz;

DROP INDEX instance_live_slot;
CREATE UNIQUE INDEX instance_live_slot ON instance (hall, pool, plan_entry, slot)
    WHERE state NOT IN ('deleted', 'failed', 'lost');

-- One row per reconciliation: what Nova listed and what was done about the difference.
CREATE TABLE reconcile_record (
    id          bigserial PRIMARY KEY,
    hall        text NOT NULL REFERENCES hall (name),
    run_id      bigint REFERENCES control_run (id),
    listed      integer NOT NULL CHECK (listed >= 0),
    drift       integer NOT NULL CHECK (drift >= 0),
    body        jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX reconcile_record_hall ON reconcile_record (hall, created_at);
