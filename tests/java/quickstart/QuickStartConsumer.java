import java.util.concurrent.CountDownLatch;

import org.apache.rocketmq.client.consumer.DefaultMQPushConsumer;
import org.apache.rocketmq.client.consumer.listener.ConsumeConcurrentlyStatus;
import org.apache.rocketmq.client.consumer.listener.MessageListenerConcurrently;
import org.apache.rocketmq.common.consumer.ConsumeFromWhere;
import org.apache.rocketmq.common.message.MessageExt;

public class QuickStartConsumer {
    public static void main(String[] args) throws Exception {
        CountDownLatch three = new CountDownLatch(3);
        DefaultMQPushConsumer consumer = new DefaultMQPushConsumer("quickstart-consumer");
        consumer.setNamesrvAddr(System.getProperty("namesrv", "127.0.0.1:9876"));
        consumer.setConsumeFromWhere(ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET);
        consumer.subscribe("quickstart", "*");
        consumer.registerMessageListener((MessageListenerConcurrently) (msgs, context) -> {
            for (MessageExt msg : msgs) {
                System.out.printf("Received %s%n", new String(msg.getBody()));
                three.countDown();
            }
            return ConsumeConcurrentlyStatus.CONSUME_SUCCESS;
        });
        consumer.start();
        three.await();
        consumer.shutdown();
    }
}
