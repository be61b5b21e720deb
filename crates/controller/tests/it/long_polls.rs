//! What one node's long-polls can hold (issue 24).

use std::sync::Arc;
use std::time::{Duration, Instant};

use trellis_controller::publish::POLLS_PER_NODE;
use trellis_controller::{BundleAnswer, BundleRequest, Controller};
use trellis_proto as proto;

use super::{enrol_request, on_both};

/// The long-polls open now, as a scrape shows them.
async fn open(c: &Controller) -> usize {
    let scrape = c.scrape().await;
    let line = scrape.lines().find_map(|l| l.strip_prefix("trellis_long_polls_open ")).unwrap_or_else(|| panic!("{scrape}"));
    line.parse().unwrap()
}

/// Waits (at most 5 s) until `done` holds.
async fn until(mut done: impl AsyncFnMut() -> bool) -> bool {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(5) {
        if done().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// The attack: one member's certificate opens thousands of long-polls at once. Before, every one
/// was held for its minute (3,000 held 85 MB). Now a node holds at most `POLLS_PER_NODE`: each
/// one more answers the oldest at once (what it holds is current), and the newest go on waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_node_holds_at_most_a_few_long_polls_and_the_oldest_answer_at_once() {
    on_both(|fx| async move {
        let c = Arc::new(fx.c);
        let req = proto::TokenRequest { node: "db-1".into(), ttl_secs: 600, ..Default::default() };
        let (req, _) = enrol_request(&c.create_token(&req).await.unwrap().token);
        let enrolled = c.enrol(req).await.unwrap();
        let der = trellis_pki::pem_to_der(&enrolled.node_cert_pem, "CERTIFICATE").unwrap();
        let who = c.authenticate_node(Some(&der)).await.unwrap();
        let held = match c.bundle_answer(&who, BundleRequest::default()).await.unwrap() {
            BundleAnswer::Whole { tag, .. } => tag,
            _ => panic!("a node holding nothing is sent its bundle whole"),
        };

        let extra = 3;
        let mut polls = Vec::new();
        for i in 0..POLLS_PER_NODE + extra {
            let (poller, who) = (c.clone(), who.clone());
            polls.push(tokio::spawn(async move {
                let ask = BundleRequest { held: Some(held), takes_delta: false, held_files: Vec::new(), wait: Duration::from_secs(60) };
                let answer = poller.bundle_answer(&who, ask).await;
                (answer, Instant::now())
            }));
            // Each poll is open before the next one comes, so which is oldest is known.
            let answered = i.saturating_sub(POLLS_PER_NODE - 1);
            let settled = until(async || {
                open(&c).await == (i + 1).min(POLLS_PER_NODE) && polls.iter().filter(|p| p.is_finished()).count() == answered
            })
            .await;
            let finished = polls.iter().filter(|p| p.is_finished()).count();
            assert!(settled, "after {} long-polls of one node: {} open, {finished} answered", i + 1, open(&c).await);
        }
        let (pushed_out, waiting) = polls.split_at_mut(extra);
        for p in pushed_out {
            let (answer, _) = p.await.unwrap();
            assert!(
                matches!(answer.unwrap(), BundleAnswer::Current { tag, .. } if tag == held),
                "the oldest are told what they hold is current"
            );
        }
        assert!(waiting.iter().all(|p| !p.is_finished()), "the newest go on waiting");
        assert_eq!(open(&c).await, POLLS_PER_NODE);

        c.stop();
        for p in waiting {
            let (answer, _) = tokio::time::timeout(Duration::from_secs(10), p).await.expect("answered when stopping").unwrap();
            assert!(matches!(answer.unwrap(), BundleAnswer::Current { .. }));
        }
        assert_eq!(open(&c).await, 0);
    })
    .await;
}
