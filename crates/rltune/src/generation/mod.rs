//! Generation.
