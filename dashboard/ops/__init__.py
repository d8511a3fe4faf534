"""What an operator watches: /metrics, health, security event counts, database write counts (bench
fleet-sim). Called by views and middleware."""
