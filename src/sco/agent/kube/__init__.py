"""The Kubernetes drain path of a node (the scheduler factory, ``sco.agent.scheduler``, builds it).

``node`` (the path the agent holds) -> ``drain`` (taint and evict through the API, watch the pods go) with
``spark_order`` (executors first, a driver last) and ``events`` (Kubernetes Events about the drain); around a
silent API server, ``fallback`` (logind inhibitor and kubelet's graceful node shutdown). ``credential`` renews the
agent's bound token.
"""
