import os

# Loopback-only machines: UCX must use the loopback device (tests that need UCX rely on it).
os.environ.setdefault("UCX_NET_DEVICES", "lo")
