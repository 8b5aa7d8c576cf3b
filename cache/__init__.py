"""The shared kernel cache: content-addressed entries, per-key file locks, exactly-once builds."""
