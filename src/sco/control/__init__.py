"""Control plane: demand intake, portfolio planner, fallback arbiter, acquirer (seed view 07).

Sits above the schedulers (it reads their pending work) and the provider; the node plane never imports it.
"""
