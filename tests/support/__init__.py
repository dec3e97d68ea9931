"""Fixtures kvtier's own tests (and a few scripts run from the checkout) use: a stand-in libcuda for
kvikio on CPU-only machines (fake_cuda), a slow TCP proxy (slow_proxy). Not installed with kvtier."""
