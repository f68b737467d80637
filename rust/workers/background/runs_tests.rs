//! Unit tests of `workers::background::runs`: replay, caps, stages, windows.
use super::*;
use futures_util::StreamExt;

#[tokio::test]
async fn events_are_kept_whole_and_replayed_after_a_sequence_number() {
    let runs = Runs::default();
    let run = runs.start("resp_1", None, 0).unwrap();
    run.push(b"event: a\ndata: {\"sequence_number\":0}\n\n: keep-alive\n\nevent: b\ndata: {\"seq");
    run.push(b"uence_number\":1}\n\n");
    let late = tokio::spawn(run.clone().follow(Some(0)).collect::<Vec<_>>());
    run.push(b"event: c\ndata: {\"sequence_number\":2}\n\n");
    run.finish();
    let got: Vec<Bytes> = late.await.unwrap().into_iter().map(Result::unwrap).collect();
    assert_eq!(got.len(), 2);
    assert!(got[0].starts_with(b"event: b") && got[1].starts_with(b"event: c"));
    assert_eq!(run.clone().follow(None).count().await, 3);
    assert!(!run.stop(), "a finished run is not stopped");
}

#[test]
fn runs_are_capped_per_owner_and_in_all_and_an_ended_one_frees_its_place_at_once() {
    let runs = Runs::new(Limits { max_runs: 3, per_owner: 2, replay_bytes: 1 << 20 });
    let (a, b) = (Owner::for_key("a"), Owner::for_key("b"));
    let a1 = runs.start("r1", Some(&a), 0).unwrap();
    runs.start("r2", Some(&a), 0).unwrap();
    assert!(matches!(runs.start("r3", Some(&a), 0), Err(ApiError::BackgroundOwnerFull(2))));
    runs.start("r4", Some(&b), 0).unwrap();
    assert!(matches!(runs.start("r5", Some(&b), 0), Err(ApiError::BackgroundFull(3))));
    runs.ended(&a1);
    assert!(runs.get("r1").is_some(), "kept for replay");
    runs.start("r6", Some(&a), 0).unwrap();
    assert_eq!(runs.held().0, 3);
}

#[test]
fn a_stop_and_its_holders_end_exclude_each_other() {
    let runs = Runs::default();
    let ending = runs.start("r1", None, 0).unwrap();
    assert!(ending.generating() && ending.begin_end());
    assert!(!ending.stop() && !ending.give_up(), "its holder writes its end: nobody stops it");
    // A short request's end is recorded (from its rank's thread) before its run reads the answer: it still ran.
    let quick = runs.start("r0", None, 0).unwrap();
    assert!(quick.begin_end() && quick.generating(), "its stream is still read and kept for its readers");
    let stopped = runs.start("r2", None, 3).unwrap();
    assert!(stopped.stop() && stopped.is_stopped());
    assert!(!stopped.generating() && !stopped.begin_end(), "stopped: its holder writes nothing more");
    assert!(matches!(stopped.claim("me"), Claim::Held { owner: "me", generation: 3 }));
    assert!(runs.claimed().is_empty(), "no claim in the store yet");
    stopped.set_claimed();
    assert_eq!(runs.claimed().len(), 1);
    runs.ended(&stopped);
    assert!(runs.claimed().is_empty(), "ended");
}

#[test]
fn a_run_keeps_its_window_and_ended_runs_their_budget() {
    let runs = Runs::new(Limits { max_runs: 1, per_owner: 1, replay_bytes: MIN_REPLAY_WINDOW_BYTES });
    let run = runs.start("r1", None, 0).unwrap();
    let event = |i: usize| format!("event: x\ndata: {{\"sequence_number\":{i},\"pad\":\"{}\"}}\n\n", "p".repeat(1000));
    for i in 0..200 {
        run.push(event(i).as_bytes());
    }
    let kept_from = run.kept_from().expect("the oldest went");
    assert!(kept_from > 100 && kept_from < 199, "{kept_from}");
    assert!(run.events.lock().unwrap().bytes <= MIN_REPLAY_WINDOW_BYTES);
    runs.ended(&run);
    let second = runs.start("r2", None, 0).unwrap();
    second.push(event(0).as_bytes());
    runs.ended(&second);
    assert!(runs.get("r1").is_none(), "the oldest ended run goes past the budget");
    assert!(runs.get("r2").is_some());
}
