"""The control plane's side of the cache box: its CacheEntry mirror kept in step with the store, and
Django's cache on the cache box's server. Called by actions and settings."""
