"""The front door's flows: save, read, restore, verify."""
