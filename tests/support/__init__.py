"""Helpers the test modules share: tiny stores and the tensors they must hold, a handle on a live
cache manager, the io_uring probe, a running `flashmoe run`'s output, trace slices and the shared
traces' presence, the policy goldens, a stand-in Docker engine. Test modules import these from
here and never from one another; conftest.py holds only fixtures and hooks."""
