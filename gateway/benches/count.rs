//! Counting an upstream's prompt (`upstream/count.rs`): kvgate's `cl100k_base` counter (the
//! runtime's word scanner + tiktoken's merge) against tiktoken-rs's own `encode_ordinary` (its
//! regex engine + the same merge), side by side on the same texts: a short chat message, a
//! sentence, and a long prompt (~4,000 tokens of prose, code and numbers).
//!
//! Run: `cargo bench -p kvgate-gateway --bench count`.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvgate_gateway::upstream::TiktokenCounter;
use kvgate_gateway::validate::PromptCodec;

fn texts() -> Vec<(&'static str, String)> {
    let sentence = "You are a helpful assistant. Answer briefly, and cite the sources you used \
                    (2024 edition, pages 12-17).";
    let unit = "The quick brown fox doesn't jump over 1,234 lazy dogs; it can't.\n\
                fn main() {\n    println!(\"{}\", 40 + 2);\n}\n\
                Les élèves étudient à l'école — 日本語のテキストも少し。\n\n";
    vec![
        ("short", "Say ok.".to_owned()),
        ("sentence", sentence.to_owned()),
        ("long", unit.repeat(80)),
    ]
}

fn count(c: &mut Criterion) {
    let counter = TiktokenCounter::for_model("gpt-4");
    let tiktoken = tiktoken_rs::cl100k_base_singleton();
    let mut group = c.benchmark_group("cl100k_encode");
    for (name, text) in texts() {
        assert_eq!(counter.encode(&text), tiktoken.encode_ordinary(&text));
        group.bench_with_input(BenchmarkId::new("kvgate", name), &text, |b, text| {
            b.iter(|| counter.encode(black_box(text)))
        });
        group.bench_with_input(BenchmarkId::new("tiktoken-rs", name), &text, |b, text| {
            b.iter(|| tiktoken.encode_ordinary(black_box(text)))
        });
    }
    group.finish();
}

criterion_group!(benches, count);
criterion_main!(benches);
