-- Enrolment (issue 28): a one-time token per launched instance, exchanged by the instance at first boot for its
-- relay identity and Kubernetes credential (sco.control.enrolment). Only the token's SHA-256 is kept, bound to the
-- instance record; what was issued is kept so that it can be taken back when the instance is deleted.

CREATE TABLE enrolment (
    instance_id        bigint PRIMARY KEY REFERENCES instance (id),
    token_sha256       text NOT NULL CHECK (token_sha256 ~ '^[0-9a-f]{64}$'),
    created_at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- set once, by the one request that enrolled (NULL: not used yet)
    used_at            timestamptz,
    used_from          text,
    nkey_public        text,
    -- the relay identity issued: the node's account (public key) and when it was issued (a revocation's JWT
    -- must not be older than the account JWT it replaces)
    node               text,
    account            text,
    account_issued_at  bigint,
    kube_expires_at    timestamptz,
    -- when the relay stored the revoked account JWT (NULL: not revoked)
    revoked_at         timestamptz,
    CHECK ((used_at IS NULL) = (account IS NULL))
);
-- What the revocation sweep reads: enrolled, not yet revoked.
CREATE INDEX enrolment_to_revoke ON enrolment (instance_id) WHERE used_at IS NOT NULL AND revoked_at IS NULL;
