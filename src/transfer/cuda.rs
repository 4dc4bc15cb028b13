//! CUDA backend (placeholder until implemented).
