"""From released datasets to the generator's source layout (`prepare`, `adapters`, `preprocess`), and from that
layout to tasks (`scan`)."""
