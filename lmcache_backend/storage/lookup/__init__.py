"""The cross-process index through which the scheduler sees what the worker's store
holds: its folder's life, and what a killed engine leaves in ``/dev/shm``."""
