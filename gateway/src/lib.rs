//! kvgate's OpenAI-compatible admission gateway: validation, tenant policy, fair queues,
//! admission by live KV occupancy, and the HTTP server.
#![forbid(unsafe_code)]

pub mod admission;
pub mod auth;
pub mod error;
pub mod extract;
pub mod generate;
pub mod handlers;
pub mod inspect;
pub mod intake;
pub mod metrics;
pub mod openai;
pub mod policy;
pub mod queue;
pub mod ratelimit;
pub mod reload;
pub mod request_log;
pub mod server;
pub mod shutdown;
pub mod stack;
pub mod state;
pub mod stream;
pub mod telemetry;
pub mod upstream;
pub mod validate;
