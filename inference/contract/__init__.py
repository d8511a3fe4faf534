"""What boards and the control plane say to each other: the typed messages and their signed, sealed
envelopes. Imported by both sides."""
