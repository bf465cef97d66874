"""REST-style retrieval drafting: a suffix-array datastore and the drafter over it."""
