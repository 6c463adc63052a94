"""``lmcache-backend bench --load``: many concurrent RAG chats against one server, and the
store's eviction policies replayed on the same workload."""
