"""State and record (seed view 07): the fleet state in PostgreSQL. Used by the control plane and the provider;
never by the node plane."""
