"""The shared tier (``remote_url``): Redis (one server, a Cluster or Sentinel), its URL,
its servers and commands, outages, authenticated entries, and the shared copy kept
genuine while an engine serves from memory."""
