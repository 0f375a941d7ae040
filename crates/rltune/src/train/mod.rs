//! Supervised trainers: SFT and reward models. Placeholder.
