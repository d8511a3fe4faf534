"""Live updates: broadcasting to open pages (Channels group ``live``), the WebSocket consumer, and a
run followed as its board streams it (the Run page and the API's streams). Called by actions and views."""
