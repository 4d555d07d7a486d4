"""Node plane: what runs on every reclaimable instance.

Depends on the contract layer (the signed bundle) and the scheduler adapters only; never on the control
plane, so a control-plane outage costs convergence, not drain (seed view 07).
"""
