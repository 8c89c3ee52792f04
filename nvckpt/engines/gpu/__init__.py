"""The GPU engines: encode (save), decode (load), snapshot (async_save), over a device Backend."""
