"""Blind expert review of edits and of the judge: sampling, the answer store, the page, export and the report."""
