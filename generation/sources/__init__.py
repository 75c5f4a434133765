"""From released datasets to the generator's source layout (`prepare`, `adapters/` one module per dataset family,
`preprocess`), and from that layout to tasks (`scan`)."""
