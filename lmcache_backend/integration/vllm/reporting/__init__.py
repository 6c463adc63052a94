"""What the connector reports: one record per request in the stats file, and its counters
in vLLM's Prometheus ``/metrics``."""
