"""What an attacker, a lying board or another tenant tries, and what holds (the threat model: docs/operations.md)."""
