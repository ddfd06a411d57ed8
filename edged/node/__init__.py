"""The node: sandbox records and their state machine, admission against capacity, the manager
that drives a backend, and the reaper of expired sandboxes."""
