-- Enrolment (issue 28): the Node object a node's Kubernetes token was bound to, so that the revocation sweep can
-- delete that Node (and so end the token) once its instance is gone, on a hall with no cloud controller manager to
-- do it. Only the Node with this uid is ever deleted: one registered again under the name (another object) is not.
-- And where the node's agent serves its metrics (the enrolment service lists it for Prometheus's file_sd).
ALTER TABLE enrolment
    ADD COLUMN metrics_target text,
    ADD COLUMN node_uid       text,
    -- when the sweep settled the Node (NULL: not yet), and how: deleted, gone (already), replaced (another
    -- object or another instance holds the name: left alone)
    ADD COLUMN node_done_at   timestamptz,
    ADD COLUMN node_outcome   text CHECK (node_outcome IN ('deleted', 'gone', 'replaced')),
    ADD CHECK ((node_done_at IS NULL) = (node_outcome IS NULL));
CREATE INDEX enrolment_node_to_delete ON enrolment (instance_id) WHERE node_uid IS NOT NULL AND node_done_at IS NULL;
