//! Attacks on what the API keeps per request (issue 24): each test sends the requests an
//! attacker would and shows what they can no longer grow.

use trellis_store::testdb;

use super::start;

/// The series of the request latency histogram in a scrape.
fn request_series(scrape: &str) -> Vec<&str> {
    scrape.lines().filter(|l| l.starts_with("trellis_http_request_duration_seconds_count{")).collect()
}

/// The attack: unauthenticated requests with made-up methods and paths. Before, the method was a
/// label as sent, so each made-up method made a series (5,000 of 4,000 bytes made one scrape
/// 410 MB). Now methods outside a fixed set are `other` and paths no route matches `unmatched`:
/// however many are sent, the series are the same few.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn made_up_methods_and_paths_make_no_new_metric_series() {
    let r = start(testdb::sqlite_url()).await;
    let send = |method: String, path: String| {
        let req = r.http.request(reqwest::Method::from_bytes(method.as_bytes()).unwrap(), format!("{}{path}", r.base));
        async move { req.send().await.unwrap().status().as_u16() }
    };
    // Warm up the series a well-behaved client makes, then count.
    assert_eq!(send("GET".into(), "/v1/health".into()).await, 200);
    let before = request_series(&r.controller.scrape().await).len();
    for i in 0..100 {
        let method = format!("M{i:03}{}", "X".repeat(1000));
        send(method.clone(), "/v1/health".into()).await;
        send(method, format!("/v1/nothing-{i}")).await;
        send("GET".into(), format!("/v1/nothing/{i}/{}", "y".repeat(500))).await;
    }
    let scrape = r.controller.scrape().await;
    let series = request_series(&scrape);
    assert!(!scrape.contains("XXXX") && !scrape.contains("nothing"), "a label carries what the client sent:\n{}", series.join("\n"));
    // At most: other on a matched route (405), other and GET where no route matched (404).
    assert!(series.len() <= before + 3, "{} series after 300 made-up requests, {before} before:\n{}", series.len(), series.join("\n"));
    assert!(series.iter().any(|l| l.contains("method=\"other\"")), "{}", series.join("\n"));
    assert!(scrape.len() < 64 * 1024, "a scrape of {} bytes", scrape.len());
}
