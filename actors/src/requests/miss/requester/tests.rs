//! Tests of how a thread waits for a pool actor's answer: during the spin or after it, a
//! dropped sender, and errands run while it waits.

use super::*;

fn done(v: u8) -> Answer<u8> {
    Answer::Done(Ok(Box::new(v)))
}

fn value(r: Result<MissReply<u8>, flume::RecvError>) -> Result<Option<u8>, flume::RecvError> {
    r.map(|reply| reply.ok().map(|b| *b))
}

#[test]
fn a_reply_is_received_whether_it_comes_during_the_spin_or_after_it() {
    let (tx, rx) = flume::bounded(1);
    tx.send(done(1)).unwrap();
    assert_eq!(value(recv_spinning(&rx)), Ok(Some(1)));
    let late = std::thread::spawn(move || {
        std::thread::sleep(REPLY_SPIN * 20);
        tx.send(done(2)).unwrap();
    });
    assert_eq!(value(recv_spinning(&rx)), Ok(Some(2)));
    late.join().unwrap();
}

#[test]
fn a_dropped_sender_ends_the_wait_during_the_spin_or_after_it() {
    let (tx, rx) = flume::bounded::<Answer<u8>>(1);
    drop(tx);
    assert_eq!(
        value(recv_spinning(&rx)),
        Err(flume::RecvError::Disconnected)
    );
    let (tx, rx) = flume::bounded::<Answer<u8>>(1);
    let late = std::thread::spawn(move || {
        std::thread::sleep(REPLY_SPIN * 20);
        drop(tx);
    });
    assert_eq!(
        value(recv_spinning(&rx)),
        Err(flume::RecvError::Disconnected)
    );
    late.join().unwrap();
}

#[test]
fn errands_run_on_a_thread_that_waits_without_a_deadline_and_elsewhere_with_one() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .build()
        .unwrap();
    let me = std::thread::current().id();
    let (ran_tx, ran_rx) = flume::unbounded();
    let errand = |ran: flume::Sender<std::thread::ThreadId>| {
        let work = Box::new(move || ran.send(std::thread::current().id()).unwrap());
        Answer::Errand(crate::books::errand::Errand::new(work, rt.handle().clone()))
    };
    // One errand waiting before the wait starts, one after the spin: both run here.
    let (tx, rx) = flume::bounded(3);
    tx.send(errand(ran_tx.clone())).unwrap();
    let late_errand = errand(ran_tx.clone());
    let late = std::thread::spawn(move || {
        std::thread::sleep(REPLY_SPIN * 20);
        tx.send(late_errand).unwrap();
        tx.send(done(3)).unwrap();
    });
    assert_eq!(value(recv_spinning(&rx)), Ok(Some(3)));
    late.join().unwrap();
    assert_eq!(ran_rx.try_iter().collect::<Vec<_>>(), vec![me, me]);
    // A wait with a deadline runs none: the errand runs elsewhere, the answer comes.
    let (tx, rx) = flume::bounded(2);
    tx.send(errand(ran_tx)).unwrap();
    tx.send(done(4)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let got = answer_by(&rx, deadline).map(|r| r.ok().map(|b| *b));
    assert_eq!(got, Ok(Some(4)));
    let elsewhere = ran_rx.recv_timeout(Duration::from_secs(10));
    assert!(matches!(elsewhere, Ok(t) if t != me), "{elsewhere:?}");
}
