"""A worker group: one base model over several devices (`workers.group.runtime`)."""
