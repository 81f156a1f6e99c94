"""Paged attention: the backend interface (`base`), one file per backend (`sdpa`, `tiled`, `native`, `flex`) and
the one choice among them (`chooser`). Nothing is imported here."""
