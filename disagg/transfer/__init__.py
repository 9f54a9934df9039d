"""KV transfer between context and generation workers: layout conversion, transports, leases."""
