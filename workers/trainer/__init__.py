"""The trainer service: transport, sequencer and scheduler, operations, the engine that holds a
base model and its slots, residency and parking, checkpoints and snapshots, leases, recovery,
calibration and transfer."""
