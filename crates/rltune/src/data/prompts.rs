//! Prompt datasets. Placeholder.
