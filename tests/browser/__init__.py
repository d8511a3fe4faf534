"""The pages in a real Chromium against a running stack (marker ``browser``, from this folder)."""
