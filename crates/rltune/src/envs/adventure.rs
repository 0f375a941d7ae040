//! Placeholder: the generated text-adventure family (being written).
