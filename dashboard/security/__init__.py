"""Keys and secrets of the control plane: namespace rings and signing, text sealed at rest, sessions whose
keys the database never holds, rate limits. Called by actions, views and the API."""
