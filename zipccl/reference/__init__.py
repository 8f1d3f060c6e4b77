"""The specification: plain torch implementations every fast kernel must match byte for byte."""
