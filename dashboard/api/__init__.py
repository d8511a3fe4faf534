"""The OpenAI-compatible API (``/v1/``): applications use the fleet as they would use OpenAI.

``views`` (the endpoints, SSE streaming), ``requests`` (the body, checked field by field),
``routing`` (which board of the key's namespace answers), ``keys`` (API keys: shown once,
stored hashed), ``errors`` (OpenAI's error shape). README: "OpenAI-compatible API".
"""
