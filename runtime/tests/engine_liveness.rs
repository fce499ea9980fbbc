//! `Engine::is_running`: true while the engine thread serves, false after `shutdown`, and false
//! when the thread died on its own (a panicking backend), without anyone joining it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_runtime::backend::{Backend, BackendError, BatchInputs, MemoryUsage};
use kvgate_runtime::engine::{Engine, EngineConfig, GenerationRequest, TokenDecoder, TokenEvent};

const VOCAB: usize = 8;

/// Answers with flat logits, or panics inside `forward` when told to.
struct Backend0 {
    panic_in_forward: bool,
}

impl Backend for Backend0 {
    fn name(&self) -> &'static str {
        "liveness-test"
    }
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn forward(&mut self, inputs: &BatchInputs, logits: &mut Vec<f32>) -> Result<(), BackendError> {
        assert!(!self.panic_in_forward, "injected backend panic");
        logits.clear();
        logits.resize(inputs.num_logits_rows() * VOCAB, 0.0);
        Ok(())
    }
    fn memory(&self) -> MemoryUsage {
        MemoryUsage::default()
    }
}

struct Decoder;

impl TokenDecoder for Decoder {
    fn token_bytes(&self, _id: u32) -> &[u8] {
        b"x"
    }
    fn is_eog(&self, _id: u32) -> bool {
        false
    }
    fn is_special(&self, _id: u32) -> bool {
        false
    }
}

fn config() -> EngineConfig {
    EngineConfig {
        block_size: 4,
        num_blocks: 16,
        bytes_per_block: 64,
        max_num_seqs: 4,
        max_batched_tokens: 32,
        long_prefill_threshold: 0,
        max_model_len: 64,
        command_queue: 8,
        ..EngineConfig::default()
    }
}

fn spawn(panic_in_forward: bool) -> Engine {
    Engine::spawn(
        Box::new(Backend0 { panic_in_forward }),
        Arc::new(Decoder),
        config(),
    )
    .expect("engine starts")
}

fn request() -> GenerationRequest {
    GenerationRequest::greedy(vec![1, 2, 3], 2, "liveness")
}

#[test]
fn an_engine_runs_until_it_is_shut_down() {
    let engine = spawn(false);
    assert!(engine.is_running());
    let clone = engine.clone();
    engine.shutdown();
    assert!(!engine.is_running());
    assert!(!clone.is_running(), "clones share the state");
}

#[test]
fn a_panicked_engine_thread_is_not_running() {
    let engine = spawn(true);
    assert!(engine.is_running());
    let mut handle = engine.submit(request()).expect("accepted before the panic");
    // The thread unwinds out of `forward`: the stream ends without a Finished event.
    while let Some(event) = handle.events.blocking_recv() {
        assert!(
            !matches!(event, TokenEvent::Finished { .. }),
            "a panicking step finishes nothing"
        );
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.is_running() {
        assert!(
            Instant::now() < deadline,
            "a dead engine thread must be reported"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Joining the panicked thread is logged, not propagated.
    engine.shutdown();
    assert!(!engine.is_running());
}
