//! Metric sinks and the run report. Placeholder.
