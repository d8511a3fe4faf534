"""What the pages show, worked out apart from the views: charts and their series, device colours,
per-device figures and who may see them, answer and entry explanations, model cards, the Queue page,
the board start command. Called by dashboard.views (and the Lab page by its view)."""
