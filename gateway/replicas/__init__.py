"""Data-parallel replicas behind one gateway: where each replica's worker runs (placement on this
host; on a Ray cluster: ray_cluster, ray_replicas, the actor's worker_host, the link's view of its
worker actor_worker), what its prefix cache holds (cache_index, from the workers' KV events),
which replica takes each request (router), and the client over them all (replica_set), with
EngineClient's interface; disaggregated prefill and decode (prefill_decode): producer and
consumer workers placed as replicas are, each prompt through both, behind the same interface.

May import: gateway/api, gateway/text, gateway/metrics, gateway/link, protocol/.
"""
