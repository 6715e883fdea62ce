"""The trace simulator: the replay on a virtual clock, the learning path in-process, the
device model that turns hits into time."""
