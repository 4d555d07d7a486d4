"""Provider adapters: OpenStack Nova/Ironic, the notice relay, reservations (seed view 07)."""
