//! kvgate's embedded inference runtime: GGUF model loading, tokenizer, a paged KV block pool,
//! a continuous-batching scheduler and the engine loop that drives a [`backend::Backend`].
#![forbid(unsafe_code)]

pub mod backend;
pub mod batch;
pub mod bench;
pub mod block_pool;
pub mod chat_template;
pub mod device;
pub mod engine;
pub mod gguf;
pub mod kv_math;
pub mod loader;
pub mod model;
pub mod out_file;
pub mod plan;
pub mod provision;
pub mod requant;
pub mod sampler;
pub mod scheduler;
pub mod sequence;
pub mod synth;
pub mod tokenizer;
