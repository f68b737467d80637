"""Engine rank processes: one per data-parallel rank, fed through the shared-memory rings."""
