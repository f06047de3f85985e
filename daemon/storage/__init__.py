"""What the data directory keeps, and its guarantees: the SQLite store and its rows, the content-addressed
blobs, the sample journal, the model versions and the ``current`` link, the storage budget, consistency
checks and rebuild, storage faults. Depends on nothing else in the daemon but its config and errors."""
